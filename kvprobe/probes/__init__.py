"""The probe layer between the core (kv, patching) and ``experiments/``.

- :mod:`kvprobe.probes.case`: one :class:`Case` (pair, prefills, anchors, its row under the inclusion rule);
- :mod:`kvprobe.probes.sweep`: the labelled sweep ``{label: patch} -> {label: value}``, metric as a parameter;
- :mod:`kvprobe.probes.heads`: read/write head cells and their GQA bookkeeping;
- :mod:`kvprobe.probes.scrub`: causal-scrubbing hypotheses over KV slots and their resampling donors;
- :mod:`kvprobe.probes.decision`: a two-choice decision read (direct or after a bounded chain; candidates scored
  by teacher-forced log-probability) and prefix reuse across prompts, for the competence screen;
- :mod:`kvprobe.probes.summary` / :mod:`~kvprobe.probes.edit_summary` / :mod:`~kvprobe.probes.common`: the
  summaries every record shares (inclusion rule, recoveries and rates with CIs from :mod:`kvprobe.stats`), and
  the helpers of the mechanism probes (residual features, curves). The runner holds no probe logic.
"""

from kvprobe.probes.case import Case, case_row, cell_throughput, ld_from_recovery, probe_case, same_decision
from kvprobe.probes.sweep import KV, METRICS, BlockOut, Directional, HeadOut, Joint, materialize, sweep, sweep_logits

__all__ = ["Case", "case_row", "cell_throughput", "ld_from_recovery", "probe_case", "same_decision", "KV", "Joint", "HeadOut",
           "BlockOut", "Directional", "METRICS", "materialize", "sweep", "sweep_logits"]
