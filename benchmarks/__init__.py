"""shardserve benchmarks: every figure a ratio against a baseline measured in the same run.

Run from the repository root (the package is not installed with shardserve)::

    python -m benchmarks [--quick] [--only NAME ...] [--json benchmarks/results/<commit>.json]

Modules, one concept each:

- ``loadgen``: the one closed-loop load generator (N workers, fixed duration, warm-up
  excluded) and latency statistics;
- ``bodies``: KServe v2 request bodies (JSON and binary extension), identical for every target;
- ``floor_server``: the floor, a single-process aiohttp + onnxruntime KServe v2 server
  (JSON by orjson: ``floor``; read as the gateway reads it, numeric data straight into
  numpy: ``floor-numeric``; by Python's json: ``floor-stdlib``);
- ``broker_hop``: the broker limit, a raw request/reply over RabbitMQ with aio-pika;
- ``ceilings``: the batching and pipelining ratios of the model alone (onnxruntime
  in-process, no serving layer):
  32-row vs 1-row runs for batching, two stage slices at once vs in turn for pipelining;
- ``meshes``: real meshes (``shardserve up``) on a dedicated RabbitMQ vhost;
- ``scenarios``: what is measured, one function per named scenario;
- ``report``: the ratios against their targets, the table, the JSON file;
- ``profile`` (``python -m benchmarks.profile``): py-spy on every service of a rank-1 mesh
  under load, summarized per service (py-spy is installed separately);
- ``agent_memory`` (``python -m benchmarks.agent_memory``): agent memory experiments;
- ``hop_properties`` (``python -m benchmarks.hop_properties``): what RabbitMQ spends per
  request-hop message for quorum vs classic, confirms, ``mandatory`` and per-message TTL.
- generation (``--only generate``): ``gen_scenario`` (what is measured), ``gen_client`` (the
  streaming /v1/completions client and arrivals), ``gen_metrics`` (vLLM's TTFT/TPOT/ITL/E2EL
  and throughput, Poisson send times), ``gen_models`` (the torch environment, checkpoints and
  exports, cached), ``gen_floor`` (the unsliced model in-process, greedy), ``gen_peer``
  (transformers behind aiohttp, run in the torch environment), ``gen_report`` (the targets,
  the table; ``python -m benchmarks.gen_report FILE.json`` prints them as Markdown),
  ``gen_profile`` (py-spy and the per-step budget of a generating mesh).

Every mesh load point also records the CPU milliseconds each process (gateway,
scheduler, agents, RabbitMQ, the load generator) spent per request, from /proc.
"""
