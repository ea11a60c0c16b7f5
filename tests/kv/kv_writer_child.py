"""The process that tests/kv/test_kv_sigkill.py kills: an engine over a KV disk tier that spills blocks, with
the writer's test hook set, so it stops half way through its first block file and waits to be killed."""
import sys

from pagedllm import LLM, SamplingParams


def main(model: str, kv_dir: str, kv_cache_memory: int, block_size: int, *prompts: str) -> None:
    llm = LLM(model, dtype="float32", kv_cache_memory=kv_cache_memory, block_size=block_size, kv_cache_dir=kv_dir)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for prompt in prompts:
        llm.generate({"prompt_token_ids": [int(token) for token in prompt.split(",")]}, params, use_tqdm=False)
    llm.llm_engine.flush_kv_disk_tier()   # never returns: the writer holds mid-write until the SIGKILL


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
