# Sourced by test.sh and check.sh: what the run's interpreters compile is
# kept (where PYTHONDONTWRITEBYTECODE is set, each of the hundreds of
# interpreters a run starts would compile torch's and the tests' files
# again: 2.7 s to import torch from source, 1.3 s from bytecode).  The files
# go to __pycache__ beside their sources (ignored by git).
unset PYTHONDONTWRITEBYTECODE
