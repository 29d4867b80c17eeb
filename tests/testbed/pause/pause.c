/*
 * The bed's pause image program: a pod sandbox's first process. It holds the pod's namespaces
 * open by doing nothing, reaps the zombies that end up with it as PID 1, and exits when asked
 * (SIGINT, SIGTERM), as the kubelet and containerd expect of a sandbox image. Built static by
 * tests/testbed/pause_image.py; the bed pushes it as the OSC's sandbox image.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int sig) {
    _exit(128 + sig);
}

static void reap(int sig) {
    (void)sig;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static int handle(int sig, void (*fn)(int), int flags) {
    struct sigaction act;
    memset(&act, 0, sizeof(act));
    act.sa_handler = fn;
    act.sa_flags = flags;
    sigemptyset(&act.sa_mask);
    return sigaction(sig, &act, NULL);
}

int main(void) {
    if (getpid() != 1) {
        fprintf(stderr, "pause: not PID 1; continuing anyway\n");
    }
    if (handle(SIGINT, leave, 0) < 0 || handle(SIGTERM, leave, 0) < 0 ||
        handle(SIGCHLD, reap, SA_NOCLDSTOP | SA_RESTART) < 0) {
        perror("pause: sigaction");
        return 1;
    }
    for (;;) {
        pause();
    }
}
