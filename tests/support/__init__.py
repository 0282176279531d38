"""What the tests share and are not tests themselves: the process-world
harnesses (gloo ranks, SocketGroup worlds, in-memory thread worlds), the
scenarios they run in each rank, the vLLM harness that loads vLLM's own
files from its wheel, reference implementations and the typing checks.
No test_ module here: pytest collects nothing from this folder."""
