"""Machinery every backend shares: rendezvous, mailboxes, the stop signal, comm workers, copies, call checks."""
