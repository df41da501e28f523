"""The ``acceptance_length`` check of ``drafter_checkpoint``: the verdict on the simulated acceptance
(``drafter.evaluation.verdict``) as a Dagster check result with its figures and per-position plot."""

import dagster as dg


def acceptance_check(t, heldout, missing: list[str], png_fn, by_mode=None, drafter: str | None = None
                     ) -> dg.AssetCheckResult:
    """The check result of :func:`~eagle_assets.drafter.evaluation.verdict.acceptance_verdict`: passed at level OK,
    severity ERROR at level ERROR, else WARN; metadata: the mean with its interval, the levels, tau per partition
    (and per thinking mode, when the rows carry one), the per-position acceptance plot
    (``png_fn(curves)``) and which drafter was measured (``drafter``, ``DrafterConfig.describe()``)."""
    from eagle_assets.drafter.evaluation.verdict import acceptance_verdict  # torch: only in the run that trains
    from eagle_assets.figures.plots import png_markdown

    verdict = acceptance_verdict(t, heldout, missing, by_mode)
    curves = dict(heldout.groups)
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
    return dg.AssetCheckResult(
        check_name="acceptance_length",
        passed=verdict.level == "OK",
        severity=dg.AssetCheckSeverity.ERROR if verdict.level == "ERROR" else dg.AssetCheckSeverity.WARN,
        description=verdict.text + (f" [drafter: {drafter}]" if drafter else ""),
        metadata=metadata,
    )
