#!/usr/bin/env bash
# Pin every third-party base image in k8s/ to the digest its exact tag points at now.
#
#   k8s/pin-digests.sh           rewrite the files in place: name:tag -> name:tag@sha256:<digest>
#   k8s/pin-digests.sh --check   print each reference and its current digest, change nothing
#
# References handled: ARG RAY_TAG (rayproject/ray) and FROM / COPY --from= in k8s/Dockerfile and
# k8s/Dockerfile.mlflow, and every `image:` in k8s/base/*.yaml and k8s/overlays/*/*.yaml (MinIO)
# except the project's own images (dpfl-*, built from the Dockerfiles; pin those by digest when
# you push them, e.g. with `kustomize edit set image` in an overlay). An existing @sha256 is
# replaced by the current one, so rerunning after a tag change (or to pick up a rebuilt tag) is
# the update step; review the diff and commit it. Needs network access to the registries and one of: crane, skopeo,
# docker buildx (tried in that order). Nothing is written unless every reference resolves.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check_only=false
case "${1:-}" in
  "") ;;
  --check) check_only=true ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

resolve() {  # name:tag -> sha256:<64 hex> on stdout
  local ref=$1 digest
  if command -v crane >/dev/null 2>&1; then
    digest=$(crane digest "$ref")
  elif command -v skopeo >/dev/null 2>&1; then
    digest=$(skopeo inspect --format '{{.Digest}}' "docker://$ref")
  elif command -v docker >/dev/null 2>&1 && docker buildx version >/dev/null 2>&1; then
    digest=$(docker buildx imagetools inspect "$ref" | awk '$1 == "Digest:" {print $2; exit}')
  else
    echo "pin-digests: none of crane, skopeo, docker buildx found" >&2
    return 3
  fi
  if [[ ! $digest =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "pin-digests: no digest for $ref (got '${digest}')" >&2
    return 4
  fi
  printf '%s\n' "$digest"
}

strip_digest() { printf '%s\n' "${1%%@*}"; }

# file|kind|reference lines; kind: raytag (ARG RAY_TAG value, image rayproject/ray) or ref.
refs=()
for f in "$here/Dockerfile" "$here/Dockerfile.mlflow"; do
  while read -r tag; do refs+=("$f|raytag|$tag"); done \
    < <(sed -n 's/^ARG RAY_TAG=\([^[:space:]]*\).*/\1/p' "$f")
  while read -r ref; do
    [[ $ref == *'$'* ]] || refs+=("$f|ref|$ref")  # FROM rayproject/ray:${RAY_TAG}: via the ARG
  done < <(
    sed -n -e 's/^FROM[[:space:]]\{1,\}\([^[:space:]]*:[^[:space:]]*\).*/\1/p' \
      -e 's/^COPY[[:space:]]\{1,\}--from=\([^[:space:]]*:[^[:space:]]*\).*/\1/p' "$f")
done
for f in "$here"/base/*.yaml "$here"/overlays/*/*.yaml; do
  while read -r ref; do
    [[ $ref == dpfl-* ]] || refs+=("$f|ref|$ref")
  done < <(sed -n 's/^[[:space:]-]*image:[[:space:]]*"\{0,1\}\([^"[:space:]#]*\).*/\1/p' "$f")
done
if [[ ${#refs[@]} -eq 0 ]]; then
  echo "pin-digests: no image references found under $here" >&2
  exit 1
fi

# Resolve everything first: a failure leaves every file as it was.
pinned=()
for entry in "${refs[@]}"; do
  IFS='|' read -r file kind ref <<<"$entry"
  tag_ref=$(strip_digest "$ref")
  [[ $kind == raytag ]] && image="rayproject/ray:$tag_ref" || image=$tag_ref
  digest=$(resolve "$image")
  printf '%-45s %s  (%s)\n' "$image" "$digest" "${file#"$here"/}"
  pinned+=("$file|$kind|$ref|$tag_ref@$digest")
done
if [[ $(sed -n 's/^ARG RAY_TAG=\([^@[:space:]]*\).*/\1/p' "$here/Dockerfile") != "" ]]; then
  gpu_tag="$(sed -n 's/^ARG RAY_TAG=\([^@[:space:]]*\).*/\1/p' "$here/Dockerfile")-gpu"
  echo "GPU image: docker build ... --build-arg RAY_TAG=$gpu_tag@$(resolve "rayproject/ray:$gpu_tag")"
fi
$check_only && exit 0

escape() { printf '%s' "$1" | sed 's/[][\.*^$/]/\\&/g'; }  # for a sed pattern
for entry in "${pinned[@]}"; do
  IFS='|' read -r file kind old new <<<"$entry"
  o=$(escape "$old")
  n=$new  # name:tag@sha256:hex holds none of sed's replacement specials (/ & \) but /
  n=${n//\//\\/}
  if [[ $kind == raytag ]]; then
    sed -i "s/^ARG RAY_TAG=$o\([[:space:]]\|\$\)/ARG RAY_TAG=$n\1/" "$file"
  else
    sed -i -e "s/^\(FROM[[:space:]]\{1,\}\)$o\([[:space:]]\|\$\)/\1$n\2/" \
      -e "s/^\(COPY[[:space:]]\{1,\}--from=\)$o\([[:space:]]\|\$\)/\1$n\2/" \
      -e "s/^\([[:space:]-]*image:[[:space:]]*\"\{0,1\}\)$o\([\"[:space:]]\|\$\)/\1$n\2/" "$file"
  fi
done
echo "pinned ${#pinned[@]} references; review with: git diff -- k8s/"
