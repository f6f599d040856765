# Dashboard front-end assets. The main Makefile includes this file (`include dashboard.mk`) and
# makes `test` and `demo` depend on `assets`. uPlot comes from npm at the version pinned in
# package-lock.json and is copied into the package, so the wheel ships it and nothing is fetched
# at run time.

VENDOR := src/pgqueue/dashboard/static/vendor
VENDOR_FILES := $(VENDOR)/uPlot.iife.min.js $(VENDOR)/uPlot.min.css

.PHONY: assets clean-assets

assets: $(VENDOR_FILES)

# The copies depend on the pin itself, not on node_modules: where they are built already (a
# source distribution ships them), npm is not needed at all.
$(VENDOR)/uPlot.iife.min.js: package.json package-lock.json
	npm ci --no-audit --no-fund --ignore-scripts
	mkdir -p $(VENDOR)
	cp node_modules/uplot/dist/uPlot.iife.min.js $@
	cp node_modules/uplot/dist/uPlot.min.css $(VENDOR)/uPlot.min.css

$(VENDOR)/uPlot.min.css: $(VENDOR)/uPlot.iife.min.js

# Without npm, a goal that must build the assets stops here, while make reads its files: before
# the virtual environment and its pip install, which take a minute and would end in
# "npm: No such file or directory".
ASSET_GOALS := assets demo test screenshot
ASSETS_TO_BUILD := $(shell for f in $(VENDOR_FILES); do \
	[ -f "$$f" ] && [ "$$f" -nt package.json ] && [ "$$f" -nt package-lock.json ] || echo "$$f"; \
	done)
ifneq ($(ASSETS_TO_BUILD),)
ifneq ($(filter $(ASSET_GOALS),$(or $(MAKECMDGOALS),assets)),)
ifeq ($(shell command -v npm),)
$(error npm is needed to build the dashboard's chart library from package-lock.json: install Node.js with npm (e.g. `apt-get install npm`, `brew install node`, or https://nodejs.org) and run make again)
endif
endif
endif

clean-assets:
	rm -rf node_modules $(VENDOR)

# The README's screenshot, from a live system (throwaway PostgreSQL, real workers, Chromium).
.PHONY: screenshot
screenshot: $(STAMP) assets
	$(BIN)/python scripts/dashboard_screenshot.py --out docs/img/dashboard.png
