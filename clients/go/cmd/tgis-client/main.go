// Command tgis-client is an existing TGIS client pointed at genserve: it is built from the
// upstream TGIS proto (package fmaas, stubs in clients/go/fmaas) and knows nothing of
// genserve. Each output line is one JSON object.
//
//	tgis-client -target localhost:50051 -max-new-tokens 16 generate "Hello" "1, 2, 3,"
//	tgis-client stream "Once upon a time"
//	tgis-client info
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	fmaas "github.com/genserve/genserve/clients/go/fmaas"
)

const usage = `usage: tgis-client [flags] COMMAND [ARGS]

commands:
  generate PROMPT...  one fmaas Generate call with every prompt (answered in order)
  stream PROMPT       fmaas GenerateStream, one line per message
  info                fmaas ModelInfo

flags:
`

// result is what the tests compare: the fields every TGIS client reads.
type result struct {
	Index               int    `json:"index"`
	Text                string `json:"text"`
	InputTokenCount     uint32 `json:"input_token_count"`
	GeneratedTokenCount uint32 `json:"generated_token_count"`
	StopReason          string `json:"stop_reason"`
	StopSequence        string `json:"stop_sequence,omitempty"`
	Seed                uint64 `json:"seed,omitempty"`
	Tokens              int    `json:"tokens"`
}

func toResult(i int, r *fmaas.GenerationResponse) result {
	return result{i, r.GetText(), r.GetInputTokenCount(), r.GetGeneratedTokenCount(),
		r.GetStopReason().String(), r.GetStopSequence(), r.GetSeed(), len(r.GetTokens())}
}

func main() {
	target := flag.String("target", "localhost:50051", "server host:port")
	timeout := flag.Duration("timeout", 60*time.Second, "deadline of each call")
	maxNewTokens := flag.Uint("max-new-tokens", 20, "stopping.max_new_tokens")
	minNewTokens := flag.Uint("min-new-tokens", 0, "stopping.min_new_tokens")
	correlationID := flag.String("correlation-id", "", "x-correlation-id metadata")
	flag.Usage = func() {
		fmt.Fprint(flag.CommandLine.Output(), usage)
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() < 1 {
		flag.Usage()
		os.Exit(2)
	}
	conn, err := grpc.NewClient(*target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintf(os.Stderr, "error: bad target %q: %v\n", *target, err)
		os.Exit(2)
	}
	defer conn.Close()
	client := fmaas.NewGenerationServiceClient(conn)
	params := &fmaas.Parameters{
		Method: fmaas.DecodingMethod_GREEDY,
		Stopping: &fmaas.StoppingCriteria{
			MaxNewTokens: uint32(*maxNewTokens), MinNewTokens: uint32(*minNewTokens)},
		Response: &fmaas.ResponseOptions{GeneratedTokens: true},
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if *correlationID != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "x-correlation-id", *correlationID)
	}
	out := json.NewEncoder(os.Stdout)
	out.SetEscapeHTML(false)

	command, args := flag.Arg(0), flag.Args()[1:]
	switch {
	case command == "generate" && len(args) > 0:
		req := &fmaas.BatchedGenerationRequest{Params: params}
		for _, p := range args {
			req.Requests = append(req.Requests, &fmaas.GenerationRequest{Text: p})
		}
		var resp *fmaas.BatchedGenerationResponse
		if resp, err = client.Generate(ctx, req); err == nil {
			for i, r := range resp.GetResponses() {
				out.Encode(toResult(i, r))
			}
		}
	case command == "stream" && len(args) == 1:
		err = stream(ctx, client, params, args[0], out)
	case command == "info" && len(args) == 0:
		var info *fmaas.ModelInfoResponse
		if info, err = client.ModelInfo(ctx, &fmaas.ModelInfoRequest{}); err == nil {
			out.Encode(map[string]interface{}{
				"model_kind": info.GetModelKind().String(), "max_sequence_length": info.GetMaxSequenceLength(),
				"max_new_tokens": info.GetMaxNewTokens()})
		}
	default:
		flag.Usage()
		os.Exit(2)
	}
	if err != nil {
		s := status.Convert(err)
		fmt.Fprintf(os.Stderr, "error: %s: %s\n", s.Code(), s.Message())
		os.Exit(1)
	}
}

func stream(ctx context.Context, client fmaas.GenerationServiceClient, params *fmaas.Parameters,
	prompt string, out *json.Encoder) error {
	s, err := client.GenerateStream(ctx, &fmaas.SingleGenerationRequest{
		Request: &fmaas.GenerationRequest{Text: prompt}, Params: params})
	if err != nil {
		return err
	}
	for i := 0; ; i++ {
		msg, err := s.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		out.Encode(toResult(i, msg))
	}
}
