"""The Conductor (issue #37): a KV-cache-centric, SLO-aware choice of instance per request, with early rejection.
Rooms: ``cost`` (the cost model and the choice: predicted TTFT per candidate instance = its queue + the prefill of
what no cache holds + the load of what the pool holds; the minimum wins, and a request no instance can serve
within its TTFT SLO is rejected at once). ``kvplugins replay --routing conductor`` runs this code on a trace
(kvplugins/replay/runner.py), so the simulator and a deployed router cannot drift. docs/capacity.md."""
