# SPDX-License-Identifier: AGPL-3.0-only
"""Run by every Python kernel of the code interpreter as it starts (IPKernelApp's
`exec_files`): the two MIME types E2B's SDK reads beside Jupyter's standard ones,
`e2b/data` (a pandas DataFrame's columns) and `e2b/chart` (a matplotlib figure's data),
and the helpers that set one execution's env vars and put them back after it.

Nothing heavy is imported here: a formatter looks at `sys.modules` first, since a
DataFrame or a Figure can only exist once the user has imported pandas or matplotlib.
Everything is defined inside one function so that the user's namespace only gains the
two env helpers (hidden from `%who`).
"""


def __opendsec_startup():
    import math
    import os
    import sys

    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    ip = get_ipython()  # noqa: F821 (IPython's builtin in a kernel)

    saved = []

    def env_push(values):
        saved.append({k: os.environ.get(k) for k in values})
        os.environ.update(values)

    def env_pop():
        for k, v in (saved.pop() if saved else {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    for name, fn in (("__opendsec_env_push", env_push), ("__opendsec_env_pop", env_pop)):
        ip.user_ns[name] = fn
        ip.user_ns_hidden[name] = fn

    def plain(value):
        """A JSON-safe copy of one cell of a frame (NaN and infinities as null)."""
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        iso = getattr(value, "isoformat", None)
        if iso is not None:
            return iso()
        item = getattr(value, "item", None)  # numpy scalars
        if item is not None:
            try:
                return plain(item())
            except (TypeError, ValueError):
                pass
        return str(value)

    def data_of_frame(frame):
        # E2B's shape: each column's name to its values (`to_dict(orient="list")`).
        return {str(k): [plain(v) for v in values] for k, values in frame.to_dict(orient="list").items()}

    def number(v):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return str(v)
        return f if math.isfinite(f) else None

    def axis_of(ax, which):
        axis = ax.xaxis if which == "x" else ax.yaxis
        scale = axis.get_scale()
        return {
            which + "_label": axis.get_label().get_text() or None,
            which + "_unit": None,
            which + "_ticks": [number(t) for t in axis.get_ticklocs()],
            which + "_tick_labels": [t.get_text() for t in axis.get_ticklabels()],
            which + "_scale": scale if scale in ("linear", "log", "symlog", "logit", "function", "functionlog", "asinh") else "unknown",
        }

    def chart_of_axes(ax):
        from matplotlib.collections import PathCollection
        from matplotlib.patches import Rectangle, Wedge

        title = ax.get_title() or None
        wedges = [p for p in ax.patches if isinstance(p, Wedge)]
        if wedges:
            return {
                "type": "pie",
                "title": title,
                "elements": [{"label": w.get_label(), "angle": abs(w.theta2 - w.theta1), "radius": w.r} for w in wedges],
            }
        base = {
            "title": title,
            "x_label": ax.get_xlabel() or None,
            "y_label": ax.get_ylabel() or None,
            "x_unit": None,
            "y_unit": None,
        }
        bars = []
        ticks = list(ax.xaxis.get_ticklocs())
        labels = [t.get_text() for t in ax.xaxis.get_ticklabels()]
        for container in getattr(ax, "containers", []):
            rects = [p for p in container if isinstance(p, Rectangle)]
            group = container.get_label() or ""
            if group.startswith("_"):
                group = ""
            for r in rects:
                center = r.get_x() + r.get_width() / 2
                label = str(number(center))
                for tick, text in zip(ticks, labels):
                    if abs(tick - center) < 1e-9 and text:
                        label = text
                bars.append({"label": label, "group": group, "value": number(r.get_height())})
        if bars:
            return dict(base, type="bar", elements=bars)
        lines = [l for l in ax.get_lines() if len(l.get_xdata()) > 1 or not l.get_label().startswith("_child")]
        scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
        if not lines and not scatters:
            return dict(base, type="unknown", elements=[])
        kind = "scatter" if scatters and not lines else "line"
        if kind == "line":
            series = [(l.get_label(), zip(l.get_xdata(), l.get_ydata())) for l in lines]
        else:
            series = [(c.get_label(), c.get_offsets()) for c in scatters]
        elements = [
            {"label": "" if label.startswith("_") else label, "points": [[number(x), number(y)] for x, y in points]}
            for label, points in series
        ]
        return dict(base, type=kind, elements=elements, **axis_of(ax, "x"), **axis_of(ax, "y"))

    def chart_of_figure(fig):
        axes = [ax for ax in fig.get_axes() if ax.get_visible()]
        if not axes:
            return None
        if len(axes) == 1:
            return chart_of_axes(axes[0])
        title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
        return {"type": "superchart", "title": title, "elements": [chart_of_axes(ax) for ax in axes]}

    def instance_of(obj, module, name):
        mod = sys.modules.get(module)
        cls = getattr(mod, name, None) if mod is not None else None
        return cls is not None and isinstance(obj, cls)

    class E2BData(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

        def __call__(self, obj):
            if instance_of(obj, "pandas", "DataFrame"):
                return data_of_frame(obj)
            return super().__call__(obj)

    class E2BChart(BaseFormatter):
        # Looks at the object's class itself: selecting matplotlib's inline backend drops
        # every formatter's registered Figure printer.
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            if instance_of(obj, "matplotlib.figure", "Figure"):
                try:
                    return chart_of_figure(obj)
                except Exception:
                    return None
            return super().__call__(obj)

    display = ip.display_formatter
    for formatter in (E2BData(parent=display), E2BChart(parent=display)):
        display.formatters[formatter.format_type] = formatter
        if formatter.format_type not in display.active_types:
            display.active_types.append(formatter.format_type)


__opendsec_startup()
del __opendsec_startup
