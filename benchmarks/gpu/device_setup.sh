# Sourced on the lent GPU machine (its image has torch, transformers, numpy, pandas, rich, typer,
# safetensors, networkx, pytest, matplotlib): installs the wheels of fetch_wheels.sh into
# /tmp/site and puts it on PYTHONPATH, then links the subpackages that pyproject.toml maps
# from top-level folders (autopart.profiler = profiler/, solver/, codegen/) into autopart/, so
# that the checkout's own autopart, first on sys.path for the scripts and pytest, imports whole.
# The links are made in the device's copy of the tree only (never commit them).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for sub in profiler solver codegen; do
  [ -e "autopart/$sub" ] || ln -s "../$sub" "autopart/$sub"
done
python3 -c "import autopart.solver, autopart.profiler, autopart.codegen, ortools" || return 1
