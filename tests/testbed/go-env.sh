# shellcheck shell=sh
# Sourced by the bed's Go builds (build-controlplane.sh, build-gardener.sh, build-promtool.sh),
# after they set $cache: Go's module, build and temporary directories beside the bed's cache (so
# that removing the cache really starts from nothing), and how the bed compiles:
# - no DWARF in the compiled packages: the binaries are stripped (-s -w) anyway, and leaving it
#   out saves about 8 % of a build's CPU;
# - GOGC=400 for the compiler and the linker: their heap grows to five times the live data
#   before a collection instead of twice, which saves about a quarter of a build's CPU
#   (client-go's packages from an empty build cache: 224 CPU-s on average at Go's default of
#   100, 172 at 400) for a higher peak (the largest package's compile: 640 MB instead of 380).
# No cgo: every binary of the bed is static Go.
cache=${cache:?go-env.sh is sourced after \$cache is set}
mkdir -p "$cache/go-mod" "$cache/go-build" "$cache/go-tmp"
export GOMODCACHE="$cache/go-mod" GOCACHE="$cache/go-build" GOTMPDIR="$cache/go-tmp" \
    GOFLAGS="-mod=mod -gcflags=all=-dwarf=false" GOGC=400 CGO_ENABLED=0
