# Source this file to build or run by hand: `. scripts/env.sh`.
# It points cargo (torch-sys, rak-build) at the project's own libtorch in .venv.
_rak_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VIRTUAL_ENV="$_rak_root/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
export LIBTORCH_USE_PYTORCH=1
export RAK_ROOT="$_rak_root"
unset _rak_root
