"""The table service: one holder per host that loads each table once and
hands out sealed descriptors (``holder``), and the systemd notify and fd
store protocol it speaks (``systemd``)."""
