"""Process-group plumbing shared by every layer above: the one process-group set-up
(``process_group``), gloo's I/O threads that yield the core (``gloo_threads``) and the peer
heartbeats that end a job in seconds when a peer dies or freezes (``peer_watchdog``)."""
