# Maps the module paths the reviews import (parallel/ before its compose/ home) to today's.
import importlib, sys
for old, new in {"parallel.mesh": "parallel.compose.mesh",
                 "parallel.parallelize": "parallel.compose.parallelize",
                 "parallel.dp_plan": "parallel.compose.optim_groups",
                 "parallel.checkpoint": "parallel.compose.checkpoint"}.items():
    try:
        sys.modules[old] = importlib.import_module(new)
    except Exception:
        pass
