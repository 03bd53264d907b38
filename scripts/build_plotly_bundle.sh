#!/usr/bin/env bash
# Build dashboard/static/plotly-dashboard.min.js: plotly.js with only the trace types the dashboard
# draws (scatter, bar, heatmap, icicle; dashboard/app.py PLOTLY_TRACES), the version the installed
# plotly Python package bundles. The full plotly.min.js takes seconds to evaluate on a small
# machine; this one about a sixth of that (docs/dashboard.md, Speed).
#
# The built file is committed; run this after upgrading plotly (a unit test says when). Needs
# node and npm (the npm registry), not at install or test time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-.venv/bin/python}"
VERSION="$("$PY" -c 'from plotly.offline import get_plotlyjs_version as v; print(v())')"
TRACES="$("$PY" -c 'from gpu_trace.dashboard.app import PLOTLY_TRACES as t; print(" ".join(t))')"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
(
    cd "$WORK"
    echo '{"name": "plotly-dashboard-bundle", "version": "0.0.0", "private": true}' >package.json
    npm install --silent --no-audit --no-fund --ignore-scripts "plotly.js@$VERSION" esbuild@0.25
    {
        echo "var Plotly = require('plotly.js/lib/core');"
        for t in $TRACES; do
            [ "$t" = scatter ] || echo "Plotly.register(require('plotly.js/lib/$t'));"
        done
        echo "module.exports = Plotly;"
    } >entry.js
    # As plotly.js's own build (esbuild-config.js), less the plugins only WebGL and map traces need.
    node_modules/.bin/esbuild entry.js --bundle --minify --format=iife --global-name=Plotly \
        --define:global=window --define:define.amd=false --target=es2016 \
        --alias:regl=@plotly/regl --alias:stream=stream-browserify --log-level=warning \
        --banner:js="/*! plotly.js v$VERSION (MIT License, Copyright 2012-2026 Plotly, Inc.), traces: $TRACES. Built by scripts/build_plotly_bundle.sh */" \
        --outfile=bundle.js
)
cp "$WORK/bundle.js" dashboard/static/plotly-dashboard.min.js
echo "wrote dashboard/static/plotly-dashboard.min.js (plotly.js $VERSION: $TRACES)"
