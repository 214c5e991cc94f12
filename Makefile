# The project's commands: `make demo` (the main job) and `make test`, each from a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.14.1
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup build test demo bench lint clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.deps-installed: $(PY)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" ninja setuptools wheel \
		pytest numpy expecttest hypothesis ruff matplotlib nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
	touch $@

setup: $(VENV)/.deps-installed

# Incremental (ninja) in-place build; the lock keeps concurrent builds from clobbering _C.so.
# Then a .pth file puts this checkout on the venv's sys.path, so fusedamp imports from any
# folder and under torchrun, without the second compile an install would cost.
build: setup
	flock .build.lock $(PY) setup.py --quiet build_ext --inplace
	$(PY) -c 'import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "fusedamp-checkout.pth").write_text("$(CURDIR)\n")'

test: build
	$(PY) -m pytest $(PYTEST_ARGS)

demo: build
	$(PY) -m fusedamp.demo $(DEMO_ARGS)

bench: build
	$(PY) -m benchmarks

lint: setup
	$(PY) -m ruff check fusedamp tests benchmarks tools setup.py

clean:
	rm -rf build fusedamp/_C*.so fusedamp/_build_meta.py
