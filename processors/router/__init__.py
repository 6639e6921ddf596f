"""Router v2: token ids in, vLLM's hybrid hit per node, a score against load and a chosen node.

Pure logic, no server: `model` (request/answer Structs), `request` (checks), `hashing` (token ids →
each group's hashes per hash configuration), `decide` (hits, score, choice, merge across workers),
`inflight` (speculative holdings of routed requests), `openapi` (the document), `client` (sync and
async HTTP client). Its benchmark is `kvpipe.bench.route` (in process) and `kvpipe.bench.route_http`
(`kvpipe bench route`, in process and over HTTP). The routing app serves them through `kvpipe.processors.router.serving` and `kvpipe.processors.routing.views`.
"""
