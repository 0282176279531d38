"""The store: the table file format, backing files (tmpfs, hugetlbfs, memfd),
page placement on NUMA nodes, garbage collection of dead tables, and the
chunked copy helper.

May import: ``errors``, ``units``, ``bindings``, ``model``, ``host``.  Never
torch.
"""
