"""The ``acceptance_length`` check of ``drafter_checkpoint``: the verdict on the simulated acceptance
(``drafter.checkpoint_eval``) as a Dagster check result with its figures and per-position plot."""

import dagster as dg


def acceptance_check(t, heldout, unseen, missing: list[str], png_fn, unseen_note: str | None = None,
                     by_mode=None, drafter: str | None = None) -> dg.AssetCheckResult:
    """The check result of :func:`~eagle_assets.drafter.checkpoint_eval.acceptance_verdict`: passed at level OK,
    severity ERROR at level ERROR, else WARN; metadata: the mean with its interval, the levels, tau per partition
    (and per thinking mode, and on the unseen source, when measured), the per-position acceptance plot
    (``png_fn(curves)``) and which drafter was measured (``drafter``, ``DrafterConfig.describe()``)."""
    from eagle_assets.drafter.checkpoint_eval import acceptance_verdict  # torch: only in the run that trains
    from eagle_assets.figures.plots import png_markdown

    verdict = acceptance_verdict(t, heldout, unseen, missing, unseen_note, by_mode)
    curves = dict(heldout.groups)
    if unseen is not None:
        curves["unseen source"] = unseen
    metadata = {
        "drafter_architecture": drafter,
        "mean_tau": heldout.mean_tau,
        "mean_tau_ci95": dg.MetadataValue.json(heldout.mean_tau_ci95),
        "tau_error_at_or_under": verdict.error_at,
        "tau_warn_under": verdict.warn_under,
        "k": t.acceptance_k,
        "per_partition": dg.MetadataValue.json(heldout.summary()),
        **{f"tau_{k}": round(r.tau, 4) for k, r in heldout.groups.items()},
        "per_position_acceptance": dg.MetadataValue.md(png_markdown(png_fn(curves), "per-position acceptance")),
        "partitions_without_heldout_rows": dg.MetadataValue.json(list(missing)),
    }
    if by_mode is not None:
        metadata["tau_by_thinking"] = dg.MetadataValue.json(by_mode.summary())
    if unseen is not None:
        metadata.update({
            "unseen_tau": round(unseen.tau, 4),
            "unseen_tau_ci95": dg.MetadataValue.json([round(x, 4) for x in unseen.tau_ci95]),
            "unseen": dg.MetadataValue.json({
                "rows": unseen.n_rows, "verifications": unseen.n_verifications,
                "tau_row_sd": round(unseen.tau_row_sd, 4),
                "per_position_acceptance": [round(a, 4) for a in unseen.per_position_acceptance]}),
        })
    return dg.AssetCheckResult(
        check_name="acceptance_length",
        passed=verdict.level == "OK",
        severity=dg.AssetCheckSeverity.ERROR if verdict.level == "ERROR" else dg.AssetCheckSeverity.WARN,
        description=verdict.text + (f" [drafter: {drafter}]" if drafter else ""),
        metadata=metadata,
    )
