"""The table service: one holder per host that loads each table once and
hands out sealed descriptors (``tableservice``), its socket
(``listener``), and the systemd notify and fd store protocol it speaks
(``systemd``)."""
