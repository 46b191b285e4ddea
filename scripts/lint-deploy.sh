#!/usr/bin/env bash
# Lints the Dockerfile and the Helm chart, and validates every manifest the chart renders.
#
#   bash scripts/lint-deploy.sh     # from anywhere; installs its tools once (scripts/deploy-tools.sh)
#
# 1. hadolint: the Dockerfile; any finding, down to style, fails.
# 2. helm lint --strict: the chart, with its default values and each deploy/helm/nibble/ci/*-values.yaml.
# 3. helm template + schema validation, for the default values, each ci/*-values.yaml and each file
#    in deploy/examples/: every object against the Kubernetes JSON schemas of $KUBE_VERSIONS with
#    kubernetes-validate --strict (unknown fields are errors; a kind without a schema is an error);
#    ServiceMonitors and KEDA ScaledObjects (CRDs) against their CRD schemas instead
#    (deploy/ci/crd-check.mjs). Every NIBBLE_* variable the chart and the Dockerfile set must be
#    declared by a flag of the workspace (deploy/ci/check-env.py).
# 4. The checks bite: each ci/invalid/*.yaml renders but must FAIL validation with the error its
#    `# expect:` line names, and each ci/refused/*.yaml must make `helm template` fail (the
#    chart's own checks or values.schema.json) with the error its `# expect:` line names.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS=(1.27.0 1.37.0)
CHART=deploy/helm/nibble

TOOLS=$(bash scripts/deploy-tools.sh)
HELM="$TOOLS/bin/helm"
PYTHON="$TOOLS/venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

passed=0
failed=0
pass() {
    passed=$((passed + 1))
    echo "ok   $*"
}
fail() {
    failed=$((failed + 1))
    echo "FAIL $*"
}

# Renders the chart with the values files given ("" for the defaults) and validates the result.
# Prints the validators' output to $work/log; returns non-zero when validation fails.
validate() {
    local values=$1 args=()
    [[ -n "$values" ]] && args=(-f "$values")
    : >"$work/log"
    if ! "$HELM" template nibble "$CHART" --namespace nibble "${args[@]}" \
        >"$work/rendered.yaml" 2>>"$work/log"; then
        echo "render failed" >>"$work/log"
        return 2
    fi
    local status=0
    "$PYTHON" deploy/ci/validate-manifests.py "$work/rendered.yaml" "$work/crds.json" \
        "${KUBE_VERSIONS[@]}" >>"$work/log" 2>&1 || status=1
    if [[ "$(cat "$work/crds.json")" != "[]" ]]; then
        cp deploy/ci/crd-check.mjs "$TOOLS/npm/"
        node "$TOOLS/npm/crd-check.mjs" "$work/crds.json" >>"$work/log" 2>&1 || status=1
    fi
    return "$status"
}

# 1. Dockerfile.
if "$TOOLS/bin/hadolint" --no-color --failure-threshold style Dockerfile >"$work/log" 2>&1; then
    pass "hadolint Dockerfile"
else
    fail "hadolint Dockerfile"
    cat "$work/log"
fi

# 2. helm lint.
for values in "" "$CHART"/ci/*-values.yaml; do
    args=()
    [[ -n "$values" ]] && args=(-f "$values")
    if "$HELM" lint --strict --quiet "$CHART" "${args[@]}" >"$work/log" 2>&1; then
        pass "helm lint ${values:-(default values)}"
    else
        fail "helm lint ${values:-(default values)}"
        cat "$work/log"
    fi
done

# 3. Render and validate.
mkdir "$work/valid"
n=0
for values in "" "$CHART"/ci/*-values.yaml deploy/examples/*.yaml; do
    if validate "$values"; then
        pass "valid: ${values:-(default values)}"
        n=$((n + 1))
        cp "$work/rendered.yaml" "$work/valid/$n.yaml"
    else
        fail "invalid: ${values:-(default values)}"
        cat "$work/log"
    fi
done
# Every NIBBLE_* variable the chart and the Dockerfile set must be one a flag declares.
if "$PYTHON" deploy/ci/check-env.py . "$work"/valid/*.yaml >"$work/log" 2>&1; then
    pass "environment: $(tail -n 1 "$work/log")"
else
    fail "environment: the chart or the Dockerfile sets variables no flag declares"
    cat "$work/log"
fi

# 4. The checks must reject what is broken.
for values in "$CHART"/ci/invalid/*.yaml; do
    status=0
    validate "$values" || status=$?
    expect=$(sed -n 's/^# expect: //p' "$values")
    if [[ -z "$expect" ]]; then
        fail "$values has no '# expect: ERROR' line"
    elif ((status == 1)) && grep -qF -- "$expect" "$work/log"; then
        pass "rejected as invalid: $values ($expect)"
    elif ((status == 1)); then
        fail "expected $values to fail validation with '$expect'; it failed otherwise"
        cat "$work/log"
    elif ((status == 2)); then
        fail "expected $values to render and fail validation; it did not render"
        cat "$work/log"
    else
        fail "expected $values to fail validation; it passed"
    fi
done
for values in "$CHART"/ci/refused/*.yaml; do
    expect=$(sed -n 's/^# expect: //p' "$values")
    if [[ -z "$expect" ]]; then
        fail "$values has no '# expect: ERROR' line"
    elif "$HELM" template nibble "$CHART" -f "$values" >/dev/null 2>"$work/log"; then
        fail "expected the chart to refuse $values; it rendered"
    elif grep -qF -- "$expect" "$work/log"; then
        pass "refused by the chart: $values ($expect)"
    else
        fail "expected the chart to refuse $values with '$expect'; it failed otherwise"
        cat "$work/log"
    fi
done

echo "lint-deploy: $passed passed, $failed failed"
((failed == 0))
