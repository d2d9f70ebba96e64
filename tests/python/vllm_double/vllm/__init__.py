"""Test double of vLLM (see tests/python/vllm_double/README.md). Not vLLM."""

IS_TEST_DOUBLE = True
