#!/usr/bin/env bash
# From a clean venv, outside the checkout: install the repaired wheel, run every entry form.
set -uo pipefail
wheel=$1
venv=/tmp/wheel-venv
rm -rf "$venv" /tmp/wheel-run && mkdir -p /tmp/wheel-run && cd /tmp/wheel-run
python3 -m venv "$venv" && source "$venv/bin/activate"
pip install -q --upgrade pip
echo "\$ pip install $(basename "$wheel")"
pip install -q "$wheel" 2>&1 | grep -v "WARNING: Location" | tail -3
pip list 2>/dev/null | grep -iE "^(torch|pycomm|numpy) "
run() { echo; echo "\$ $*"; "$@" 2>&1 | tail -${TAIL:-6}; echo "(exit ${PIPESTATUS[0]})"; }
run python -c "import pycomm, pycomm.parallel, importlib.util as u; print(pycomm.__file__); print(pycomm.parallel.__file__); print('top-level parallel:', u.find_spec('parallel'))"
run python -m pycomm.env
run pycomm-env
run python -m pycomm.parallel.planner --model gpt --world 4 --memory-gb 0.05
TAIL=4 run pycomm-plan --model gpt --world 2 --memory-gb 0.05
run python -m pycomm.parallel.train --steps 3 --dp 2 --log-every 1
run pycomm-train --steps 3 --dp 2 --log-every 1
run python -m torch.distributed.run --standalone --nproc-per-node 2 -m pycomm.examples.train_ddp --steps 3
cat > /tmp/wheel-run/no_import.py <<'PY'
import datetime, sys
import torch, torch.distributed as dist
print("after import torch: pycomm in backend_list:", "pycomm" in dist.Backend.backend_list,
      "| pycomm imported:", "pycomm" in sys.modules)
dist.init_process_group("pycomm", store=dist.HashStore(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
t = torch.ones(3); dist.all_reduce(t)
print("init_process_group('pycomm') without import pycomm:", t.tolist(),
      type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__)
dist.destroy_process_group()
PY
run python /tmp/wheel-run/no_import.py
run python -c "import pycomm, datetime, torch, torch.distributed as dist; dist.init_process_group('pycomm', store=dist.HashStore(), rank=0, world_size=1); t=torch.ones(2); dist.all_reduce(t); print('with import pycomm:', t.tolist()); dist.destroy_process_group()"
run env TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -c "import torch.distributed as dist; dist.init_process_group('pycomm', store=dist.HashStore(), rank=0, world_size=1)"
deactivate
