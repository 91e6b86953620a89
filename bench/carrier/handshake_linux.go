package carrier

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// synDelay holds each TCP SYN sent to the relay's port for a round trip
// before the kernel sees it, so that a client's connect takes as long as on
// the path: the handshake crosses the carrier instead of being answered on
// loopback at once. An iptables rule in the mangle table's OUTPUT chain
// hands those SYNs to an NFQUEUE numbered as the port (ports being unique
// among live listeners, so are the queues, across processes), and this
// reads the queue over netlink and gives each packet its verdict, accept,
// when its delay has passed.
//
// Only the SYN is delayed: the SYN-ACK and the final ACK cross loopback at
// once, which makes the whole handshake one round trip, as on a path.
type synDelay struct {
	fd    int
	queue uint16
	rule  []string // the iptables rule's match and target, for -D
	delay func() time.Duration

	writeMu sync.Mutex // verdicts are sent from timers
	wg      sync.WaitGroup
	ctx     context.Context
	cancel  context.CancelFunc
}

// Netlink's netfilter queue protocol (linux/netfilter/nfnetlink_queue.h).
const (
	nfnlSubsysQueue     = 3
	nfqnlMsgPacket      = 0
	nfqnlMsgVerdict     = 1
	nfqnlMsgConfig      = 2
	nfqaCfgCmd          = 1
	nfqaCfgParams       = 2
	nfqaPacketHdr       = 1
	nfqaVerdictHdr      = 2
	nfqnlCfgCmdBind     = 1
	nfqnlCopyMeta       = 1
	nfAccept            = 1
	nfnetlinkV0         = 0
	nlmsgHdrLen         = unix.SizeofNlMsghdr
	nfgenmsgLen         = 4
	synDelayRecvTimeout = 100 * time.Millisecond // how often the reader looks whether it should stop
)

// startSynDelay binds queue port (the relay's) and installs the rule that
// fills it. delay is asked for each SYN's hold. It needs root (CAP_NET_ADMIN)
// and iptables.
func startSynDelay(port int, delay func() time.Duration) (*synDelay, error) {
	if _, err := exec.LookPath("iptables"); err != nil {
		return nil, fmt.Errorf("carrier: a handshake through the path needs iptables (apt-get install iptables): %w", err)
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("carrier: opening a netfilter netlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("carrier: binding a netfilter netlink socket: %w", err)
	}
	tv := unix.NsecToTimeval(synDelayRecvTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("carrier: setting the netlink socket's receive timeout: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	d := &synDelay{fd: fd, queue: uint16(port), delay: delay, ctx: ctx, cancel: cancel}
	// Bind the queue, then ask for the packets' metadata only: the packet
	// id is all a verdict needs.
	cmd := []byte{nfqnlCfgCmdBind, 0, 0, 0}
	binary.BigEndian.PutUint16(cmd[2:], unix.AF_INET)
	params := make([]byte, 5)
	params[4] = nfqnlCopyMeta
	for _, attr := range []struct {
		typ  uint16
		data []byte
	}{{nfqaCfgCmd, cmd}, {nfqaCfgParams, params}} {
		if err := d.request(nfqnlMsgConfig, attr.typ, attr.data, true); err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("carrier: configuring netfilter queue %d (needs root): %w", port, err)
		}
	}
	p := strconv.Itoa(port)
	d.rule = []string{"OUTPUT", "-p", "tcp", "-d", "127.0.0.1", "--dport", p,
		"--tcp-flags", "SYN,ACK,RST,FIN", "SYN", "-j", "NFQUEUE", "--queue-num", p, "--queue-bypass"}
	if out, err := exec.Command("iptables", append([]string{"-w", "-t", "mangle", "-A"}, d.rule...)...).CombinedOutput(); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("carrier: adding the rule that queues SYNs to port %d (needs root): %w: %s", port, err, out)
	}
	d.wg.Add(1)
	go d.read()
	return d, nil
}

// close removes the rule, stops reading and lets every held SYN through.
func (d *synDelay) close() error {
	out, err := exec.Command("iptables", append([]string{"-w", "-t", "mangle", "-D"}, d.rule...)...).CombinedOutput()
	if err != nil {
		err = fmt.Errorf("carrier: removing the rule that queues SYNs to port %d: %w: %s", d.queue, err, out)
	}
	d.cancel() // pending timers give their verdicts at once
	d.wg.Wait()
	unix.Close(d.fd)
	return err
}

// read gives each queued SYN its verdict once its delay has passed.
func (d *synDelay) read() {
	defer d.wg.Done()
	buf := make([]byte, 64<<10)
	for d.ctx.Err() == nil {
		n, _, err := unix.Recvfrom(d.fd, buf, 0)
		if err != nil {
			if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) || errors.Is(err, unix.ENOBUFS) {
				continue // the timeout, or a burst the socket could not hold: those SYNs are retransmitted
			}
			return
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			continue
		}
		for _, m := range msgs {
			if m.Header.Type != nfnlSubsysQueue<<8|nfqnlMsgPacket {
				continue
			}
			id, ok := packetID(m.Data)
			if !ok {
				continue
			}
			d.hold(id, d.delay())
		}
	}
}

// hold accepts packet id after delay, or at once when d closes.
func (d *synDelay) hold(id uint32, delay time.Duration) {
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-d.ctx.Done():
		}
		v := make([]byte, 8)
		binary.BigEndian.PutUint32(v, nfAccept)
		binary.BigEndian.PutUint32(v[4:], id)
		d.request(nfqnlMsgVerdict, nfqaVerdictHdr, v, false)
	}()
}

// packetID returns the id in a queued packet's message: after its
// nfgenmsg, the attribute NFQA_PACKET_HDR begins with it.
func packetID(data []byte) (uint32, bool) {
	if len(data) < nfgenmsgLen {
		return 0, false
	}
	for a := data[nfgenmsgLen:]; len(a) >= 4; {
		l := int(binary.NativeEndian.Uint16(a))
		typ := binary.NativeEndian.Uint16(a[2:]) &^ (unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
		if l < 4 || l > len(a) {
			return 0, false
		}
		if typ == nfqaPacketHdr && l >= 8 {
			return binary.BigEndian.Uint32(a[4:]), true
		}
		a = a[min(len(a), (l+3)&^3):]
	}
	return 0, false
}

// request sends one netfilter queue message of type msg with one attribute;
// with ack, it waits for the kernel's answer.
func (d *synDelay) request(msg, attrType uint16, attr []byte, ack bool) error {
	attrLen := 4 + len(attr)
	b := make([]byte, nlmsgHdrLen+nfgenmsgLen+(attrLen+3)&^3)
	flags := uint16(unix.NLM_F_REQUEST)
	if ack {
		flags |= unix.NLM_F_ACK
	}
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], nfnlSubsysQueue<<8|msg)
	binary.NativeEndian.PutUint16(b[6:], flags)
	g := b[nlmsgHdrLen:]
	g[0], g[1] = unix.AF_UNSPEC, nfnetlinkV0
	binary.BigEndian.PutUint16(g[2:], d.queue)
	a := g[nfgenmsgLen:]
	binary.NativeEndian.PutUint16(a, uint16(attrLen))
	binary.NativeEndian.PutUint16(a[2:], attrType)
	copy(a[4:], attr)
	d.writeMu.Lock()
	err := unix.Sendto(d.fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
	d.writeMu.Unlock()
	if err != nil || !ack {
		return err
	}
	// Configuration happens before the rule exists: the answer is the next
	// message.
	buf := make([]byte, 4096)
	n, _, err := unix.Recvfrom(d.fd, buf, 0)
	if err != nil {
		return fmt.Errorf("waiting for the kernel's answer: %w", err)
	}
	msgs, err := syscall.ParseNetlinkMessage(buf[:n])
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if m.Header.Type == unix.NLMSG_ERROR && len(m.Data) >= 4 {
			if errno := int32(binary.NativeEndian.Uint32(m.Data)); errno != 0 {
				return unix.Errno(-errno)
			}
			return nil
		}
	}
	return errors.New("no answer from the kernel")
}
