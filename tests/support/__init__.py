"""Fakes and helpers the tests share. A test module imports them from here, never from another test module
(``tests/unit/test_markers.py`` checks), so each test file can be read, run and changed on its own."""
