# Sourced (from the repo root) by the scripts that run on a GPU machine (the device image: JAX
# with CUDA, no venv): scripts/test_gpu.sh, scripts/multi_gpu.sh. Wheels the image lacks or
# holds at other versions come from .whl/ (scripts/gpu_wheels.sh fetches them; carry .whl),
# the repo goes on PYTHONPATH, and the pinned versions and the GPU backend are checked.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 - <<'PY'
import importlib.metadata as md, jax
pins = {"jax": "0.11.2", "flax": "0.12.10", "optax": "0.2.8", "orbax-checkpoint": "0.12.4",
        "chex": "0.1.92"}
have = {p: md.version(p) for p in pins}
print("devices:", jax.devices(), "| versions:", have)
assert jax.default_backend() == "gpu", "no GPU: this script is for the GPU machine"
bad = {p: v for p, v in have.items() if v != pins[p]}
assert not bad, f"versions differ from the pins {pins}: {bad} (carry .whl)"
PY
