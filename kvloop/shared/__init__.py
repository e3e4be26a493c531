"""kvloop's bottom floor: what every service shares. Imports no service (``kvloop.broker``, ``.engines``,
``.router``) and nothing of the composition root; the broker's pure core may import only :mod:`.errors` and
:mod:`.hashing` from here."""
