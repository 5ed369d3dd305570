"""The watching daemon: which files to convert, when, and the records of what it did.

Data flows one way: `watcher` (inotify or polling events) -> `queue` (one worker per path at a time, due
times) -> `sync.Syncer` (asks `readiness` whether a file is settled and complete, `ownership` where its output
goes and whose file is there, then calls the engine) -> records: `state` (the SQLite database of what was
converted or failed), `synclog` (one JSON line per decision; `statuses` names them), `journal` (a line per
record for journald), `status` (the status file and STATUS=), `metrics` (a Prometheus textfile), `notify`
(systemd). `service.Daemon` wires them and handles signals; `config` reads the YAML configuration; `names`
decides candidates by name; `access`, `logread` and `retry` serve the CLI's check-config, log and retry
commands, which print from `syncd/cli/`.
"""
