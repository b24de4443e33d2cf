"""gpu-handoff: the tower agent of GPU Handoff.

One stdlib-only program (Python >= 3.9), built into one file (build.py),
that Home Assistant runs over SSH as a forced command. It reads libvirt through ``virsh`` (argv lists, never a shell),
answers one JSON object per line, and runs long work (graceful stops, starts
that wait for PCI functions to free up) as detached jobs whose progress is kept
in JSON files under the state directory. A `session` keeps one connection
open: requests answered, and the tower's state pushed as it changes.

It never destroys a domain: every stop is a graceful shutdown, and a stop that
does not finish in time leaves the domain running and fails the job.

Trust: the state directory belongs to the user the agent runs as (Home
Assistant's SSH user) and nobody else may write to it. Run as root (the libvirt
hook, an administrator's command), the agent becomes that user before it
touches the directory; every file in it is reached from a directory descriptor
without following symbolic links, and runners act on what the configuration
allows, never on what a record says.

The modules, each one concern, depend on one another in one direction (each
imports only modules listed before it): wire, config, virsh, state, observe,
jobs, runner, screenshot, hook, status, stream, requests, session, accounts,
keys, install, update, cli. Home Assistant imports ``wire`` alone.

Every start pays for what it imports, and libvirt waits for the hook's at
every start and stop of a VM: ``cli`` imports a verb's module when the verb
runs, and ``typing`` is imported only for the type checker (each module's
``TYPE_CHECKING = False`` block, which works on Python 3.9 as on the newest).
"""
