"""How long an idle leader gathers a burst of arriving requests into one prefill (no torch: the
driver checks its settings against this before anything starts)."""

BURST_WAIT_CAP = 10
"""A burst is gathered for at most this many burst waits in all, however steadily requests trickle in.
The 16 requests of 16 HTTP clients sending at once reached the leader over 24-47 ms on a 2-core host
(README, Measured, machine K): a cap of 4 waits (40 ms) cut some bursts, and the requests left
outside waited out the whole prefill of the others (about 4 s) before their own began."""
