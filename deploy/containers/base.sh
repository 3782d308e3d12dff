#!/usr/bin/env bash
# A local base image for Containerfile.cpu, made from Debian's packages, for machines that reach
# Debian's archive but no container registry (so `FROM python:3.11-slim-bookworm` cannot be pulled).
#
#   deploy/containers/base.sh [IMAGE]        # default IMAGE: localhost/squall-base:bookworm
#   podman build --pull=never --build-arg BASE=localhost/squall-base:bookworm \
#     -f deploy/containers/Containerfile.cpu -t squall-cpu .
#
# What is in it: Debian bookworm's minimal base (debootstrap --variant=minbase) plus python3
# (3.11), python3-venv and ca-certificates: the same Debian release and Python minor version as
# the public python:3.11-slim-bookworm, so the image built on either behaves the same.
# The root filesystem is packed once into a tarball under $SQUALL_CACHE (default ~/.cache/squall),
# named by the inputs below; a later call (CI's fresh clones on one machine) only imports it.
# Needs root, debootstrap and podman (apt-get install debootstrap podman).
set -euo pipefail

IMAGE=${1:-localhost/squall-base:bookworm}
SUITE=${SQUALL_BASE_SUITE:-bookworm}
MIRROR=${SQUALL_BASE_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates
CACHE=${SQUALL_CACHE:-$HOME/.cache/squall}

fail() { echo "base.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "debootstrap needs root (run it as root, or use the public python:3.11-slim-bookworm base)"
command -v podman >/dev/null || fail "podman is missing: apt-get install podman runc"

# Bump LAYOUT when what goes into the root filesystem changes (the tarball name changes with it).
LAYOUT=1
key=$(echo "$LAYOUT $SUITE $MIRROR $PACKAGES" | sha256sum | cut -c1-12)
tarball=$CACHE/base-$SUITE-$key.tar
if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || fail "debootstrap is missing: apt-get install debootstrap"
  mkdir -p "$CACHE"
  rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "base.sh: debootstrap $SUITE from $MIRROR into $rootfs (about a minute)"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; fail "debootstrap failed (full log: $rootfs.log)"; }
  rm -f "$rootfs.log"
  # What an image needs no copy of: package lists, apt's archive, docs and man pages.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
  # `python` as well as `python3`, as in the python:*-slim images.
  ln -sf python3 "$rootfs/usr/bin/python"
  tar -C "$rootfs" --numeric-owner -cf "$tarball.part" .
  mv "$tarball.part" "$tarball"
fi
# Imported once per tarball: a new import would be a new image id, and every image built on it
# would miss podman's layer cache and rebuild from scratch.
if [ "$(podman image inspect -f '{{index .Labels "squall.base"}}' "$IMAGE" 2>/dev/null)" = "$key" ]; then
  echo "base.sh: $IMAGE is up to date ($tarball)"
  exit 0
fi
podman import --quiet \
  --change "LABEL squall.base=$key" \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$tarball" "$IMAGE" >/dev/null
echo "base.sh: $IMAGE from $tarball ($(du -h "$tarball" | cut -f1))"
