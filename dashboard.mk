# Dashboard front-end assets. The main Makefile includes this file (`include dashboard.mk`) and
# makes `test` and `demo` depend on `assets`. uPlot comes from npm at the version pinned in
# package-lock.json and is copied into the package, so the wheel ships it and nothing is fetched
# at run time.

VENDOR := src/pgqueue/dashboard/static/vendor
VENDOR_FILES := $(VENDOR)/uPlot.iife.min.js $(VENDOR)/uPlot.min.css

.PHONY: assets clean-assets

assets: $(VENDOR_FILES)

node_modules/.package-lock.json: package.json package-lock.json
	npm ci --no-audit --no-fund --ignore-scripts

$(VENDOR)/%: node_modules/.package-lock.json
	mkdir -p $(VENDOR)
	cp node_modules/uplot/dist/$* $@

clean-assets:
	rm -rf node_modules $(VENDOR)

# The README's screenshot, from a live system (throwaway PostgreSQL, real workers, Chromium).
.PHONY: screenshot
screenshot: $(STAMP) assets
	$(BIN)/python scripts/dashboard_screenshot.py --out docs/img/dashboard.png
