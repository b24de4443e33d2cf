"""Real parts the tests run: private libvirtd and sshd servers."""
