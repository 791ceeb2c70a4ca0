"""Generation in the scheduler: sequences advanced step by step over the mesh (pure core).

``machine.GenerationMachine`` is the facade the shell calls; the other modules are its parts:
``sequences`` (one request's state), ``text_stream`` (tokens -> text deltas and stop
decisions), ``chunks`` (the numbered GenerateChunks), ``admission`` (KV budget and the waiting
queue), ``steps`` and ``lanes`` (continuous batching, one lane per pipeline stage),
``resolve`` (a GenerateRequest -> a version and prompt ids).
"""
