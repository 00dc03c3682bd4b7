#!/usr/bin/env bash
# What cannot run on a machine without a Docker engine or a cluster, rendered and validated instead:
# `docker compose config` for every profile, `kustomize build` of the base and of each overlay, and
# kubeconform over the result against the Kubernetes schemas (plus KEDA's ScaledObject).
# Neither has committed credentials: both render with random ones that `tide secrets` makes here, in a
# temporary folder (the k8s tree is copied there, so its git-ignored Secret env files are test values).
# The tools come from the Go module proxy and are built once into ~/.cache/tide/tools.
# `check_deploy.sh tools` only builds them and fetches the schema sources (no Python needed): `make`
# runs it beside the pip install, one downloading while the other compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MODE=${1:-check}
TOOLS=${TIDE_TOOLS:-$HOME/.cache/tide/tools}
K8S=v1.34.2 KEDA=v2.21.0 KUBECONFORM=v0.8.0 KUSTOMIZE=v5.8.2 COMPOSE=v5.6.0
export GOBIN=$TOOLS/bin GOTOOLCHAIN=local
mkdir -p "$GOBIN"

moddir() {  # module@version -> its source folder in the module cache (downloaded if missing)
    local dir
    dir=$(go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [ -n "$dir" ] || { echo "go mod download $1: no source folder" >&2; return 1; }
    echo "$dir"
}

build() {  # name module/package@version
    [ -x "$GOBIN/$1" ] && return
    echo "building $1 from the Go module proxy (once)"
    go install "$2"
}
build kubeconform "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM"
build kustomize "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE"
if [ ! -x "$GOBIN/docker-compose" ]; then
    # compose's go.mod has exclude directives, which `go install pkg@version` refuses: build it as the
    # main module from its source in the module cache
    echo "building docker-compose from the Go module proxy (once, a few minutes)"
    src=$(moddir "github.com/docker/compose/v5@$COMPOSE")
    work=$(mktemp -d) && cp -r "$src/." "$work" && chmod -R u+w "$work"
    (cd "$work" && go build -trimpath -o "$GOBIN/docker-compose" ./cmd)
    rm -rf "$work"
fi

schemas=$TOOLS/schemas-$K8S-keda-$KEDA
if [ ! -d "$schemas" ]; then
    k8s=$(moddir "k8s.io/kubernetes@$K8S")
    keda=$(moddir "github.com/kedacore/keda/v2@$KEDA")
fi
[ "$MODE" = tools ] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r infra/k8s "$work/k8s"
rm -f "$work"/k8s/base/secrets/*.env  # the real ones, if this checkout has them, stay out of the check
"$(dirname "$PY")/tide" secrets --data "$work/state" --k8s "$work/k8s/base/secrets" > /dev/null

echo "== docker compose config"
plugins=$work/docker
mkdir -p "$plugins/cli-plugins" && ln -s "$GOBIN/docker-compose" "$plugins/cli-plugins/docker-compose"
for profile in cpu gpu; do
    if command -v docker > /dev/null && DOCKER_CONFIG=$plugins docker compose version > /dev/null 2>&1; then
        DOCKER_CONFIG=$plugins docker compose --env-file "$work/state/secrets.env" --profile "$profile" config --quiet
    else
        "$GOBIN/docker-compose" --env-file "$work/state/secrets.env" --profile "$profile" config --quiet
    fi
    echo "compose profile $profile: valid"
done

echo "== kubeconform"
if [ ! -d "$schemas" ]; then
    "$PY" scripts/k8s_schemas.py --swagger "$k8s/api/openapi-spec/swagger.json" \
        --crd "$keda/config/crd/bases/keda.sh_scaledobjects.yaml" --out "$schemas.tmp"
    mv "$schemas.tmp" "$schemas"
fi
for dir in "$work"/k8s/base "$work"/k8s/overlays/*/; do
    echo "${dir#"$work"/}"
    "$GOBIN/kustomize" build "$dir" | "$GOBIN/kubeconform" -strict -summary \
        -schema-location "$schemas/{{ .ResourceKind }}_{{ .Group }}_{{ .ResourceAPIVersion }}.json" -
done
