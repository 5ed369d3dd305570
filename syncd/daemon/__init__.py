"""The watching daemon: configuration, state, sync log, service notifications."""
