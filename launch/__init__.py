"""Launch: the tools around a run, at the top of the stack (nothing imports them).

Cluster checks before a run (`doctor`), the capacity planner (`plan`, with its own
workload profile `plan_profile`) and the virtual-clock simulator (`simulate`, its models in
`sim/`, calibrated by `calibrate`), the run report (`report`, `report_data`,
`report_figures`), and the quickstart's warm start (`quickstart`), which a recipe names by
import string.
"""
