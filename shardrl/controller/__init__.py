"""Single controller on Ray: resource pools (`pool`), worker groups of one actor per rank (`group`), dispatch of calls
over ranks (`dispatch`), the Ray runtime (`cluster`) and each worker's process setup (`host`). Import from the
modules: `dispatch` is what the workers need, and it must not pull Ray into a process that has no use for it (the
GPU benches run without Ray)."""
