"""The job description: the config schema, its rules, the model check and the planner that compiles the config into
every role's options (see docs/architecture.md)."""
