"""The routes, one module per resource, each with its `router`: meta (/api/health, /api/presets), runs
(/api/runs and everything under a run), sweeps (/api/sweeps) and pages (the two HTML pages). Each route is
a few lines over the RunStore and the dependencies in deps.py; an ApiError it lets through becomes its
HTTP status in app.py."""
