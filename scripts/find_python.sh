#!/usr/bin/env bash
# Prints a Python >= 3.12 interpreter: $PYTHON if set, else python3.13/python3.12/python3 on PATH,
# else one of pyenv's. jax >= 0.11 needs 3.12.
ok() { "$@" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
if [ -n "${PYTHON:-}" ] && ok "$PYTHON"; then echo "$PYTHON"; exit 0; fi
for c in python3.13 python3.12 python3; do
  if command -v "$c" >/dev/null 2>&1 && ok "$c"; then command -v "$c"; exit 0; fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for v in $(pyenv versions --bare 2>/dev/null | sort -rV); do
    p="$root/versions/$v/bin/python"
    if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
  done
fi
echo "no Python >= 3.12 found: install one, or set PYTHON=/path/to/python3.12" >&2
exit 1
