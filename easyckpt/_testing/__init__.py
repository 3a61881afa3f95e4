"""Internal: what the test suite needs to drive easyckpt's engine in one interpreter (the real Agent over an
in-process transport, ranks as threads). Not part of the public API; nothing in the product imports it."""
