"""Stand-in for SGLang's compiled CPU kernel package (test-only)."""

_OPS = ("assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu", "assign_draft_cache_locs_contiguous_cpu",
        "assign_extend_cache_locs_cpu", "build_tree_kernel_efficient_cpu", "fill_accept_out_cache_loc_cpu",
        "fill_bonus_tokens_cpu", "verify_tree_greedy_cpu")


def _missing(name):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not available in the CPU stand-in")
    op.__name__ = name
    return op


for _name in _OPS:
    globals()[_name] = _missing(_name)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
