"""GPU Handoff, running: Home Assistant with the integration against simulated
towers and an emulated Kubernetes cluster, all on 127.0.0.1.

- one or more towers (``--towers``), each a tower simulator (tests/towersim)
  with a GPU node VM holding a GTX 960 and two RTX 3050s and two gaming VMs
  that each want one RTX 3050, behind its own OpenSSH sshd whose
  authorized_keys forces the real tower agent (``towers.py``); what each VM
  shows on its screen (``screens.py``);
- the Kubernetes API emulator (tests/k8semu) with one GPU node per tower, its
  workloads and a PodDisruptionBudget (``cluster.py``), and per tower a
  stand-in kubelet (tests/support/kubelet.py, shared with the tests) that
  follows the simulated VM as a real node's kubelet does (silent when it
  stops, so the node turns Unknown only after the grace period; Ready with a
  new bootID after each boot, the GPUs once the device plugin registered)
  and puts the evicted workloads back once the node serves again;
- Home Assistant as its own process, configured as a current installation is
  (``home_assistant.py``), onboarded through its onboarding API, each tower
  added through the real config flow and, with ``--lend``, its options flow
  (``client.py``), and a dashboard (``dashboard.py``);
- the simulator's "Play a ghost GPU node" switch on that dashboard, a toggle
  helper the demo follows to make the GPU node a ghost in the cluster
  emulator, or heal it (``ghost.py``);
- with ``--guided``, a fresh tower to try the config flow's guided install
  on: the tests' (tests/support/box_tower.py), booted under its own systemd,
  with real accounts, sudo, ssh.service and libvirtd.service (libvirt's test
  driver), and a node of its own in the cluster (``fresh.py``);
- the packages Home Assistant's frontend needs, installed once into the cache
  (``packages.py``); the orchestration (``demo.py``); a browser screenshot
  (``screenshot.py``).

    scripts/demo                   # interactive: prints the URL and the login
    scripts/demo --fast            # guests 100x faster
    scripts/demo --towers 2        # two towers side by side, one cluster
    scripts/demo --scripted        # one handoff and return per tower, then exit
    scripts/demo --lend            # keep lending the free cards while someone plays
    scripts/demo --play            # start with each tower's first station playing
    scripts/demo --ghost           # start with each GPU node playing a ghost
    scripts/demo --guided          # also a fresh tower for "Install the agent for me"
    scripts/screenshot             # docs/dashboard.png from a headless browser
    scripts/screenshot docs/guided-install.png --guided
                                   # the guided install's confirm step

Ctrl-C (or SIGTERM) stops everything.
"""
