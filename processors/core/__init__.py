"""The shared core of both apps: the live index, what feeds it (ingest), what keeps it
(snapshots, restore, rebalance), block lifetimes, and the plumbing both Faust apps use (delivery,
Kafka settings, HTTP bodies and tokens, CLI helpers), and the one door to the native core (`native`: which engine
runs, and why not native). Imports no other part of processors/."""
