/* The simulated virsh as a client of the tower simulator's fork server
 * (forkserver.py), as the real virsh is a client of libvirtd.
 *
 * Each call is still one process of the simulator: the server forks a copy
 * of itself, its modules already imported, which runs this call's command
 * with this process's stdin, stdout and stderr (passed over the socket),
 * arguments, environment, working directory and umask, while this process
 * waits for it and ends as it ends (its exit code, or its signal). What a
 * caller does to this process reaches that copy: SIGINT, SIGTERM, SIGHUP,
 * SIGQUIT, SIGUSR1 and SIGUSR2 are passed on, and if this process dies (a
 * SIGKILL) the copy gets SIGIO from its end of the socket and dies too.
 *
 * The configuration is the file ".NAME.conf" beside this program (NAME its
 * own name), lines of key=value: socket, uid, mntns and pidns (the server's
 * user and namespaces: this program asks the server only from the same
 * ones), state and tool (what the server runs), and exec (repeated: the
 * program and arguments run instead, with this call's arguments after them,
 * when the server cannot be asked), env (repeated: NAME=VALUE set for that
 * program).
 *
 * Standard C and Linux only: built by forkserver.py with the machine's cc.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define MAX_LIST 32
#define FAILED 125

static char socket_path[PATH_MAX];
static char state[PATH_MAX];
static char tool[64];
static unsigned long want_uid = (unsigned long)-1;
static unsigned long long want_mntns, want_pidns;
static char *exec_argv[MAX_LIST];
static int exec_argc;
static char *exec_env[MAX_LIST];
static int exec_envc;

static volatile sig_atomic_t child_pid;
static volatile sig_atomic_t pending[NSIG];
static const int forwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};
#define N_FORWARDED (int)(sizeof(forwarded) / sizeof(forwarded[0]))

static void die(const char *what) {
    fprintf(stderr, "tower simulator client: %s: %s\n", what, strerror(errno));
    _exit(FAILED);
}

static void read_config(void) {
    char exe[PATH_MAX], conf[PATH_MAX + 16];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n < 0)
        die("/proc/self/exe");
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    *slash = '\0';
    snprintf(conf, sizeof(conf), "%s/.%s.conf", exe, slash + 1);
    FILE *f = fopen(conf, "r");
    if (!f)
        die(conf);
    char line[PATH_MAX + 64];
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        char *value = strchr(line, '=');
        if (!value)
            continue;
        *value++ = '\0';
        if (!strcmp(line, "socket"))
            snprintf(socket_path, sizeof(socket_path), "%s", value);
        else if (!strcmp(line, "state"))
            snprintf(state, sizeof(state), "%s", value);
        else if (!strcmp(line, "tool"))
            snprintf(tool, sizeof(tool), "%s", value);
        else if (!strcmp(line, "uid"))
            want_uid = strtoul(value, NULL, 10);
        else if (!strcmp(line, "mntns"))
            want_mntns = strtoull(value, NULL, 10);
        else if (!strcmp(line, "pidns"))
            want_pidns = strtoull(value, NULL, 10);
        else if (!strcmp(line, "exec") && exec_argc < MAX_LIST - 1)
            exec_argv[exec_argc++] = strdup(value);
        else if (!strcmp(line, "env") && exec_envc < MAX_LIST)
            exec_env[exec_envc++] = strdup(value);
    }
    fclose(f);
    if (exec_argc == 0) {
        errno = EINVAL;
        die("no exec line in the configuration");
    }
}

static void unblock(void) {
    sigset_t set;
    sigemptyset(&set);
    sigprocmask(SIG_SETMASK, &set, NULL);
}

/* The simulator started as its own process, as without the server. */
static void run_alone(int argc, char **argv) {
    char *args[MAX_LIST + argc];
    int i = 0;
    for (int k = 0; k < exec_argc; k++)
        args[i++] = exec_argv[k];
    for (int k = 1; k < argc; k++)
        args[i++] = argv[k];
    args[i] = NULL;
    for (int k = 0; k < exec_envc; k++)
        putenv(exec_env[k]);
    unblock();
    execv(args[0], args);
    die(args[0]);
}

static unsigned long long ns_inode(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

static int same_world(void) {
    return getuid() == want_uid && geteuid() == want_uid &&
           ns_inode("/proc/self/ns/mnt") == want_mntns &&
           ns_inode("/proc/self/ns/pid") == want_pidns;
}

static int stdio_open(void) {
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0)
            return 0;
    return 1;
}

/* The request: a 32-bit length, then NUL-ended strings: state, tool, cwd,
 * umask (octal), the signals ignored (a mask, bit N-1 for signal N, as
 * /proc's SigIgn; read before this program caught any), this process's
 * session (the simulator tells the qemu hook's own calls by it), the
 * number of arguments, the arguments, the environment. */
static char ignored[24];

static char *request(int argc, char **argv, size_t *size) {
    char cwd[PATH_MAX], mask[16], count[16], session[16];
    if (!getcwd(cwd, sizeof(cwd)))
        cwd[0] = '\0';
    mode_t old = umask(0);
    umask(old);
    snprintf(mask, sizeof(mask), "%o", (unsigned)old);
    snprintf(count, sizeof(count), "%d", argc - 1);
    snprintf(session, sizeof(session), "%d", (int)getsid(0));
    const char *head[] = {state, tool, cwd, mask, ignored, session, count};
    size_t total = 4;
    for (int i = 0; i < 7; i++)
        total += strlen(head[i]) + 1;
    for (int i = 1; i < argc; i++)
        total += strlen(argv[i]) + 1;
    for (char **e = environ; *e; e++)
        total += strlen(*e) + 1;
    char *buf = malloc(total);
    if (!buf)
        die("malloc");
    uint32_t length = (uint32_t)(total - 4);
    memcpy(buf, &length, 4);
    char *p = buf + 4;
#define PUT(s) do { size_t l = strlen(s) + 1; memcpy(p, s, l); p += l; } while (0)
    for (int i = 0; i < 7; i++)
        PUT(head[i]);
    for (int i = 1; i < argc; i++)
        PUT(argv[i]);
    for (char **e = environ; *e; e++)
        PUT(*e);
#undef PUT
    *size = total;
    return buf;
}

static int send_request(int sock, char *buf, size_t size) {
    int fds[3] = {0, 1, 2};
    char control[CMSG_SPACE(sizeof(fds))];
    memset(control, 0, sizeof(control));
    struct iovec iov = {buf, size};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(fds));
    memcpy(CMSG_DATA(cmsg), fds, sizeof(fds));
    ssize_t sent;
    do
        sent = sendmsg(sock, &msg, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    if (sent < 0)
        return 0;
    for (size_t done = (size_t)sent; done < size; done += (size_t)sent) {
        do
            sent = send(sock, buf + done, size - done, MSG_NOSIGNAL);
        while (sent < 0 && errno == EINTR);
        if (sent < 0)
            return 0;
    }
    return 1;
}

/* One reply of the server: a letter and a 32-bit number. */
static int reply(int sock, char want, int32_t *value) {
    char buf[5];
    size_t got = 0;
    while (got < sizeof(buf)) {
        ssize_t n = recv(sock, buf + got, sizeof(buf) - got, 0);
        if (n < 0 && errno == EINTR) {
            for (int i = 0; i < N_FORWARDED; i++) {
                int sig = forwarded[i];
                if (pending[sig] && child_pid) {
                    pending[sig] = 0;
                    kill((pid_t)child_pid, sig);
                }
            }
            continue;
        }
        if (n <= 0)
            return 0;
        got += (size_t)n;
    }
    if (buf[0] != want)
        return 0;
    memcpy(value, buf + 1, 4);
    return 1;
}

static void on_signal(int sig) {
    if (child_pid)
        kill((pid_t)child_pid, sig);
    else
        pending[sig] = 1;
}

int main(int argc, char **argv) {
    read_config();
    if (!same_world() || !stdio_open())
        run_alone(argc, argv);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(socket_path) >= sizeof(addr.sun_path))
        run_alone(argc, argv);
    memcpy(addr.sun_path, socket_path, strlen(socket_path) + 1);
    int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock < 0 || connect(sock, (struct sockaddr *)&addr, sizeof(addr)) < 0)
        run_alone(argc, argv); /* no server (yet, or any more) */
    /* The copy ignores what this process was started ignoring (as a
     * process of its own would have), and decides for itself what to do
     * with the signals passed on: from here they are caught, and one that
     * comes before the server says which process runs the call is passed
     * on once it does. */
    unsigned long long ignoring = 0;
    for (int sig = 1; sig < 64; sig++) {
        struct sigaction was;
        if (sigaction(sig, NULL, &was) == 0 && was.sa_handler == SIG_IGN)
            ignoring |= 1ULL << (sig - 1);
    }
    snprintf(ignored, sizeof(ignored), "%llu", ignoring);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < N_FORWARDED; i++)
        sigaction(forwarded[i], &sa, NULL);
    size_t size;
    char *buf = request(argc, argv, &size);
    if (!send_request(sock, buf, size)) {
        /* nothing runs: the server starts a call once it has all of it */
        close(sock);
        run_alone(argc, argv); /* exec restores the caught ones */
    }
    int32_t value;
    if (!reply(sock, 'P', &value)) {
        errno = EPROTO;
        die("the fork server did not start the call");
    }
    child_pid = value;
    for (int i = 0; i < N_FORWARDED; i++) {
        int sig = forwarded[i];
        if (pending[sig]) {
            pending[sig] = 0;
            kill((pid_t)child_pid, sig);
        }
    }
    if (!reply(sock, 'S', &value)) {
        errno = EPROTO;
        die("the fork server did not report how the call ended");
    }
    int status = value;
    if (WIFEXITED(status))
        _exit(WEXITSTATUS(status));
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (sig) {
        struct rlimit none = {0, 0};
        setrlimit(RLIMIT_CORE, &none);
        signal(sig, SIG_DFL);
        unblock();
        raise(sig);
    }
    _exit(128 + sig);
}
