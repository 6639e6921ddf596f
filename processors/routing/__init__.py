"""The routing app (`kvpipe processor`): Kafka → the core's live per-group index → the route and
node API. Read in the analytics app's order: `app` → `topics` → `state` → `agents` → `views`
(`metrics`, `cli`); `api` holds `/nodes`' logic, `scatter` the gather across workers, `routeserve`
the native route server's wiring, `answers` the app's own HTTP answers as Structs and `apidoc` its
OpenAPI document. Loads no ClickHouse code and imports nothing of `analytics`."""
