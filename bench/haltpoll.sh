# Sourced by the FUSE benchmarks (bench/store.sh, bench/ffuse-null/bench.sh).
#
# A FUSE request is two sleeps and two wake-ups (the caller's and the
# daemon's). In a VM whose idle vCPUs halt at once, each wake-up of an idle
# vCPU is an exit to the hypervisor: this VM boots with the cpuidle-haltpoll
# driver and haltpoll.guest_halt_poll_ns=0 on its command line, and its
# FUSE round trips then cost about twice what they cost with the kernel's
# default of 200000 ns of polling before a halt (bench/notes/store-transport.md, "Halt
# polling"). Bare metal and VMs without the driver are not affected.
#
# HALT_POLL_NS=N sets the guest's halt polling for the run; haltpoll_restore
# (call it from the EXIT trap) puts back what was there. The setting in
# force is printed, so that every result says what it was measured under.
HP=/sys/module/haltpoll/parameters/guest_halt_poll_ns
HP_WAS=$(cat "$HP" 2>/dev/null || echo none)
if [[ -n ${HALT_POLL_NS:-} && -w $HP ]]; then echo "$HALT_POLL_NS" > "$HP"; fi
echo "guest halt polling: $(cat "$HP" 2>/dev/null || echo 'not a haltpoll guest') ns; cpuidle driver $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)"
haltpoll_restore() {
    if [[ $HP_WAS != none && -w $HP ]]; then echo "$HP_WAS" > "$HP"; fi
}
