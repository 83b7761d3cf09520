"""The benchmark's modes, one module each: ``variants`` (the variants table), ``engine`` (the
engine model), ``torch_loop`` (the torch decode loop), ``devices`` (several devices), ``curve``
(hit rate against budget) and ``transfer`` (miss throughput next to the raw link)."""
