# Sourced at the start of every device call: PyCUDA + wheels, fagen on the path, and the kernel
# cache carried between calls as .device-cache/cache.tgz (fresh machines start with no cache).
source .whl/gpu-env.sh >/dev/null || return 1
export PYTHONPATH=$PWD:${PYTHONPATH:-} FAGEN_CACHE_DIR=/tmp/fagen-cache PYTHONUNBUFFERED=1
mkdir -p "$FAGEN_CACHE_DIR"
[ -f .device-cache/cache.tgz ] && tar xzf .device-cache/cache.tgz -C "$FAGEN_CACHE_DIR" 2>/dev/null
save_cache() { tar czf "$OUT/cache.tgz" -C "$FAGEN_CACHE_DIR" . ; }
