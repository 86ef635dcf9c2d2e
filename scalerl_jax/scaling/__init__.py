"""ScaleRL's predictive framework: sigmoid (and power-law) fits of pass rate against compute.

Pure numpy / scipy / matplotlib; imports nothing else from the package.
"""

from scalerl_jax.scaling.bootstrap import PAPER_A_RUN_TO_RUN, BootstrapIntervals, bootstrap_sigmoid
from scalerl_jax.scaling.compute_meter import ComputeMeter
from scalerl_jax.scaling.curves import crossing_computes, power_law, sigmoid
from scalerl_jax.scaling.fitting import (
    GPU_HOURS,
    ExtrapolationError,
    SigmoidFit,
    SigmoidGrid,
    check_curve,
    default_c_mid_range,
    default_fit_start,
    extrapolation_error,
    fit_sigmoid,
    make_grid,
)
from scalerl_jax.scaling.plot import PlotSeries, plot_scaling
from scalerl_jax.scaling.power_law_fit import PowerLawFit, fit_power_law
from scalerl_jax.scaling.runs import RunCurve, read_run, read_runs

__all__ = [
    "GPU_HOURS",
    "PAPER_A_RUN_TO_RUN",
    "BootstrapIntervals",
    "ComputeMeter",
    "ExtrapolationError",
    "PlotSeries",
    "PowerLawFit",
    "RunCurve",
    "SigmoidFit",
    "SigmoidGrid",
    "bootstrap_sigmoid",
    "check_curve",
    "crossing_computes",
    "default_c_mid_range",
    "default_fit_start",
    "extrapolation_error",
    "fit_power_law",
    "fit_sigmoid",
    "make_grid",
    "plot_scaling",
    "power_law",
    "read_run",
    "read_runs",
    "sigmoid",
]
